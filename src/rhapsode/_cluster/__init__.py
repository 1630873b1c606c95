"""
Rhapsode on a Ray cluster (docs/cluster.md): a Ray Serve deployment whose replicas each
run a node core (L{deployment}), a request router that sends each request to the node
that already holds its model (L{router}, ranking by L{ranking}), and the C{rhapsode
cluster} commands (L{commands}).

Ray is the C{cluster} extra, never the core's dependency: nothing outside this package
imports it, and of this package only L{ranking} and L{commands} import without it (the
command imports Ray when it runs).  The front, an ordinary core, reaches the cluster as
one upstream URL (C{engines.<id>.cluster}).
"""
