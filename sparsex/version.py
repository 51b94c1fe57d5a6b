"""The package version, in a module of its own so that any module (the server's OpenAPI document)
can read it without importing the package's public API, which imports the entrypoints."""
__version__ = "0.1.0"
