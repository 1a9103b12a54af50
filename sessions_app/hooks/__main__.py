"""``python -m sessions_app.hooks AGENT [--task] [PAYLOAD]`` (SPEC I1): runs the hook
(``sessions_app.hooks.entry``). Kept this short because ``install_hooks`` runs this file by
its path, compiled from source each time (I7)."""
from sessions_app.hooks.entry import main

if __name__ == "__main__":
    main()
