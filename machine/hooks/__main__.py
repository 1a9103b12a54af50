"""``python -m machine.hooks AGENT [--task] [PAYLOAD]`` (SPEC I1): runs the hook
(``machine.hooks.entry``). Kept this short because ``install_hooks`` runs this file by
its path, compiled from source each time (I7)."""
from machine.hooks.entry import main

if __name__ == "__main__":
    main()
