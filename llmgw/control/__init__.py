"""
The control plane, in layers (each imports only those below it):

  - L{llmgw.control.state}: the fleet's records and the indexes over them;
  - L{llmgw.control.core}: pure decisions over that state, and the catalog;
  - L{llmgw.control.shell}: the services that feed the core and carry out
    what it decides (reconciler, agent service, trust, limits, metrics);
  - L{llmgw.control.admin}: the admin API, its views, the watch stream and
    the fleet page;
  - L{llmgw.control.ha}: election, the shared state and the published
    routing table of a highly available control plane;

and L{llmgw.control.service}, which composes them (with a gateway) into
C{twistd llmgw control}.
"""
