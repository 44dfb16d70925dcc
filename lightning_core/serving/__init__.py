"""How the project's servers run: as child processes that die with their parent (process),
behind limits on what a client may hold before any route runs (http_edge), with request-sized
CPU work off the event loop (offload)."""
