"""What runs on the owner's machine: the worker, the agent hooks, the launcher that holds a
live agent, and the wire protocol they share with the service (``protocol``).

A program of its own: nothing here imports Django or a service app
(``tests/test_structure.py``), and the service imports only ``machine.protocol`` from it.
Kept empty: every hook imports this package first (I7).
"""
