"""Short factual passages shared by the API tests (ingestion, reuse in another order)."""

PASSAGES = [
    "The Amazon river flows through Peru, Colombia and Brazil before reaching the Atlantic Ocean. It carries more "
    "water than any other river on Earth, and its basin covers about seven million square kilometres of forest. ",
    "Mount Kilimanjaro is a dormant volcano in Tanzania. Its highest summit, Uhuru Peak, rises almost 5,900 metres "
    "above sea level, which makes it the tallest free-standing mountain in the world. ",
    "The Great Barrier Reef lies off the coast of Queensland in Australia. It is the largest coral reef system on "
    "the planet; warming seas have bleached large parts of it in recent decades. ",
    "Lake Baikal in Siberia is the deepest and oldest freshwater lake in the world. It holds about a fifth of the "
    "unfrozen fresh water on the Earth's surface and is home to the nerpa, a freshwater seal. ",
    "The Sahara is the largest hot desert in the world, covering much of North Africa. Its sand dunes can reach "
    "180 metres in height, yet most of its surface is stony plateau rather than sand. ",
    "The Danube flows from the Black Forest in Germany to the Black Sea, passing through ten countries and four "
    "capital cities: Vienna, Bratislava, Budapest and Belgrade. ",
    "The Atacama Desert in northern Chile is one of the driest places on Earth. Some of its weather stations have "
    "never recorded rain, and astronomers build telescopes there for its clear, dry skies. ",
    "The Nile is often called the longest river in the world. It flows north through eleven countries, and its "
    "yearly flood made the farmland of ancient Egypt one of the richest in the world. ",
]
