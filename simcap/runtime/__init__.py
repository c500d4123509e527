"""How the package is built and loaded: the engine's compiled modules (built at install, chosen
at import), lazy exports, and a command's start-up."""
