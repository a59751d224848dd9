"""Where a sweep runs: a loopback-only local Ray, an honest cluster connection, resource checks.

``connection`` starts a local Ray or joins a cluster (address checks, token authentication, the
environment it sets and restores; its docstring says why each is needed, measured with Ray 2.60,
docs/security.md); ``resources`` reads what this machine or the cluster's nodes offer a trial and
refuses a trial no single node can run, which Ray would queue forever (no Ray, no torch: it
answers before Ray starts); ``storage`` checks that every node reads and writes the run
directory. Nothing is re-exported: importing this package costs nothing; ``connection`` and
``storage`` import Ray.
"""
