"""The hooks' old home (before the owner's-machine side moved to ``machine/``).

Hook entries that an older ``install_hooks`` wrote into a CLI's config still run
``sessions_app/hooks/__main__.py`` (or ``-m sessions_app.hooks``); that file forwards to
``machine.hooks`` until the next ``install_hooks`` rewrites them (I5). Nothing else lives here.
"""
