"""Two real `sparsex serve` replicas behind a real nginx (deploy/nginx.conf, started by
deploy/replicas.py): least_conn spreads requests, conversation affinity pins a conversation to one
replica, and a replica killed mid-run costs no request sent after the kill.

The replicas load the model once for the module; two nginx instances (least_conn and conversation
hashing) front the same two replicas. The kill test runs last: it leaves one replica dead.
Skips only where no nginx binary is installed (Debian: apt-get install nginx).
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("sparsex_deploy_replicas", ROOT / "deploy" / "replicas.py")
replicas_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replicas_mod)

MODEL = "smollm2-135m-instruct"
# One torch thread per replica (two replicas share the machine's cores), a small KV pool, prefix
# caching (the conversation test reads its cached_tokens), short contexts.
SERVE_ARGS = ["--cache", "prefix", "--kv-cache-memory", "64M", "--max-model-len", "1024",
              "--torch-threads", "1", "--log-level", "warning"]
TIMEOUT = httpx.Timeout(300.0, connect=10.0)   # a hang guard, not a timing check


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served(replica) -> float:
    """Requests the replica finished: the sum of its sparsex:request_success_total over finish reasons."""
    text = httpx.get(replica.url + "/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in re.finditer(r"^sparsex:request_success_total\{[^}]*\} (\S+)$", text, re.M))


def chat(base_url: str, content: str, headers: dict | None = None, max_tokens: int = 4,
         messages: list | None = None) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": messages or [{"role": "user", "content": content}]}
    return httpx.post(base_url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=TIMEOUT)


def access_log(nginx) -> list[dict[str, str]]:
    """nginx's access log (deploy/nginx.conf's `sparsex` format), one dict a request: method, path,
    status, upstream (the replicas tried, in order), upstream_status, conversation (X-Conversation-Id)."""
    pattern = re.compile(r'"(\S+) (\S+) [^"]*" (\d+) \d+ upstream="([^"]*)" upstream_status="([^"]*)" '
                         r'request_time=\S+ conversation="([^"]*)"')
    keys = ("method", "path", "status", "upstream", "upstream_status", "conversation")
    return [dict(zip(keys, m.groups())) for m in map(pattern.search, nginx.access_log.read_text().splitlines()) if m]


def logged(nginx, conversation: str, timeout: float = 5.0, method: str | None = None) -> dict[str, str]:
    """The last access-log entry of a request with this X-Conversation-Id (and `method`: an earlier
    request of the same conversation may be logged already), waiting for it: nginx writes the line
    just after the response."""
    deadline = time.monotonic() + timeout
    while True:
        entries = [e for e in access_log(nginx) if e["conversation"] == conversation
                   and (method is None or e["method"] == method)]
        if entries or time.monotonic() > deadline:
            assert entries, f"no access-log line for {conversation}"
            return entries[-1]
        time.sleep(0.05)


def tried(entry: dict[str, str]) -> list[str]:
    return [a.strip() for a in entry["upstream"].split(",")]


@pytest.fixture(scope="module")
def workdir():
    # not pytest's tmp_path: that is private (0700), and nginx started as root runs its workers as nobody
    path = Path(tempfile.mkdtemp(prefix="sparsex-lb-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def replicas(workdir):
    if replicas_mod.find_nginx() is None:
        pytest.skip("nginx binary not installed (Debian/Ubuntu: apt-get install nginx)")
    reps = [replicas_mod.Replica(_free_port(), SERVE_ARGS, workdir) for _ in range(2)]
    try:
        for r in reps:
            r.start()                 # both load the model at once
        for r in reps:
            r.wait_healthy(timeout=600)
        yield reps
    finally:
        for r in reps:
            r.stop(timeout=30)


def _nginx(replicas, workdir, balance):
    nginx = replicas_mod.Nginx([r.address for r in replicas], _free_port(), workdir / f"nginx-{balance}",
                               balance=balance)
    nginx.start()
    nginx.wait_ready(timeout=60)
    return nginx


@pytest.fixture(scope="module")
def lb(replicas, workdir):
    nginx = _nginx(replicas, workdir, "least_conn")
    yield nginx
    nginx.stop(timeout=10)


@pytest.fixture(scope="module")
def lb_affinity(replicas, workdir):
    nginx = _nginx(replicas, workdir, "conversation")
    yield nginx
    nginx.stop(timeout=10)


def test_least_conn_spreads_requests_and_streams(replicas, lb):
    assert all(r.healthy() for r in replicas), "a replica is down (the kill test ran first?)"
    before = [served(r) for r in replicas]
    prompts = [f"Name a colour. Request {i}." for i in range(12)]
    with ThreadPoolExecutor(max_workers=4) as pool:          # bounded concurrency
        responses = list(pool.map(lambda p: chat(lb.url, p), prompts))
    assert [r.status_code for r in responses] == [200] * 12, [r.text[:200] for r in responses if r.status_code != 200]
    for r in responses:
        body = r.json()
        assert body["choices"][0]["finish_reason"] in ("length", "stop") and body["usage"]["completion_tokens"] >= 1
    delta = [served(r) - b for r, b in zip(replicas, before)]
    assert sum(delta) == 12 and all(d > 0 for d in delta), delta     # each replica served some

    # streaming (SSE) through nginx: events arrive as generated (proxy_buffering off), then [DONE]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 24,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0, arrivals, events = time.monotonic(), [], []
    with httpx.stream("POST", lb.url + "/v1/chat/completions", json=body, timeout=TIMEOUT) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                arrivals.append(time.monotonic())
    assert events[-1] == "[DONE]"
    assert '"completion_tokens":24' in events[-2]                 # the usage chunk
    # the events came while the tokens were generated, not all at the end of the response
    assert arrivals[-1] - arrivals[0] > 0.2 * (arrivals[-1] - t0), (t0, arrivals)


def test_conversation_affinity_keeps_a_conversation_on_one_replica(replicas, lb_affinity):
    assert all(r.healthy() for r in replicas), "a replica is down (the kill test ran first?)"
    for cid in ("conv-alpha", "conv-beta"):
        before = [served(r) for r in replicas]
        # a system prompt of this conversation's own (the id first: no cache block is shared with the other)
        messages = [{"role": "system", "content": f"{cid}: you are a terse assistant for a geography quiz. "
                     "Answer every question with one short sentence, naming the place and the country. "
                     "Never add anything else; do not apologise, do not ask questions back."}]
        cached = []
        for turn in range(3):
            messages.append({"role": "user", "content": f"Question {turn + 1}: name a large river."})
            r = chat(lb_affinity.url, "", headers={"X-Conversation-Id": cid}, messages=messages)
            assert r.status_code == 200, r.text
            answer = r.json()
            messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        delta = [served(r) - b for r, b in zip(replicas, before)]
        assert sorted(delta) == [0, 3], (cid, delta)               # all three turns on one replica
        # ... the one that holds the conversation's KV: turns 2 and 3 start from the cached prefix
        assert cached[0] == 0 and all(c > 0 for c in cached[1:]), (cid, cached)


def test_reload_adds_a_replica_to_the_upstream(replicas, workdir):
    """A replica joining: nginx starts with one replica in its upstream, `Nginx.reload` (SIGHUP) adds the
    second, and the requests sent after it reach both."""
    assert all(r.healthy() for r in replicas), "a replica is down (the kill test ran first?)"
    first, joining = replicas
    nginx = replicas_mod.Nginx([first.address], _free_port(), workdir / "nginx-reload")
    nginx.start()
    try:
        nginx.wait_ready(timeout=60)
        before = [served(r) for r in replicas]
        for i in range(2):
            assert chat(nginx.url, f"Name a fruit. Request {i}.").status_code == 200
        assert [served(r) - b for r, b in zip(replicas, before)] == [2, 0]
        nginx.reload([first.address, joining.address])
        before = [served(r) for r in replicas]
        for i in range(4):             # one at a time: least_conn ties, so round robin over both
            assert chat(nginx.url, f"Name a vegetable. Request {i}.").status_code == 200
        assert [served(r) - b for r, b in zip(replicas, before)] == [2, 2]
    finally:
        nginx.stop(timeout=10)


def test_killed_replica_costs_no_request_sent_after_the_kill(replicas, lb, lb_affinity):
    assert all(r.healthy() for r in replicas)
    victim, survivor = replicas
    # a conversation id that the affinity nginx maps to the victim (GET /v1/models is hashed too, and cheap)
    for i in range(64):
        assert httpx.get(lb_affinity.url + "/v1/models", headers={"X-Conversation-Id": f"probe-{i}"},
                         timeout=30).status_code == 200
        if tried(logged(lb_affinity, f"probe-{i}")) == [victim.address]:
            victim_conversation = f"probe-{i}"
            break
    else:
        pytest.fail("no conversation id hashed to the victim")

    n, results, done = 16, {}, threading.Semaphore(0)
    kill_time: list[float] = []

    def send(i: int) -> None:
        tag = f"kill-{i}"              # X-Conversation-Id: least_conn ignores it; the access log shows it
        sent = time.monotonic()
        r = chat(lb.url, f"Name a country. Request {i}.", headers={"X-Conversation-Id": tag}, max_tokens=8)
        first = r.status_code
        if r.status_code == 502:      # what a client does with a 502 (the OpenAI SDKs retry 5xx)
            r = chat(lb.url, f"Name a country. Request {i}.", headers={"X-Conversation-Id": tag + "-retry"},
                     max_tokens=8)
        results[i] = {"sent": sent, "first": first, "final": r.status_code, "tag": tag}
        done.release()

    before_survivor = served(survivor)
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(send, i) for i in range(n)]
        for _ in range(4):            # mid-run: 4 answered, the next ones in flight on both replicas
            assert done.acquire(timeout=300)
        victim.kill(signal.SIGKILL)
        victim.proc.wait(timeout=30)  # gone, its listening socket closed: from here on, connections are refused
        kill_time.append(time.monotonic())
        for f in futures:
            f.result(timeout=300)     # every request got an answer (no hang, no transport error)

    assert sorted(results) == list(range(n))
    assert all(r["final"] == 200 for r in results.values()), results        # none lost, client retries included
    after = [r for r in results.values() if r["sent"] > kill_time[0]]
    assert after, "no request was sent after the kill"
    assert all(r["first"] == 200 for r in after), after                     # no client retry needed
    assert all(r["first"] in (200, 502) for r in results.values())          # in flight at the kill: 502 at worst

    # What nginx did, from its access log. A POST in flight on the victim when it died was already
    # sent: nginx did not pass it on (the client got a 502, above). One that found the victim dead
    # (connection refused) went on to the survivor. Requests sent after the kill all ended there.
    log = {r["tag"]: logged(lb, r["tag"]) for r in results.values()}
    for r in results.values():
        entry = log[r["tag"]]
        if r["first"] == 502:
            assert tried(entry) == [victim.address] and entry["upstream_status"] == "502", entry
        elif len(tried(entry)) > 1:
            assert tried(entry) == [victim.address, survivor.address], entry
            assert entry["upstream_status"] == "502, 200", entry
    for r in after:
        assert tried(log[r["tag"]])[-1] == survivor.address and log[r["tag"]]["status"] == "200"
    assert served(survivor) - before_survivor >= len(after)

    # The retry itself, deterministically: the affinity nginx has not seen the victim fail yet, so the
    # victim's conversation goes to it first, is refused, and continues on the next replica of the ring.
    r = chat(lb_affinity.url, "Where is the Nile?", headers={"X-Conversation-Id": victim_conversation})
    assert r.status_code == 200, r.text
    entry = logged(lb_affinity, victim_conversation, method="POST")
    assert entry["status"] == "200", entry
    assert tried(entry) == [victim.address, survivor.address] and entry["upstream_status"] == "502, 200", entry

    # /health through either nginx still answers 200 (a GET: the survivor answers)
    for nginx in (lb, lb_affinity):
        assert httpx.get(nginx.url + "/health", timeout=30).status_code == 200
