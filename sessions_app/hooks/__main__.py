"""Forwards a hook entry written by an older ``install_hooks`` to ``machine.hooks`` (I1, I5)."""
from machine.hooks.entry import main

if __name__ == "__main__":
    main()
