"""The control plane: agent service, inventory, catalog, placement, reconciler, admin API."""
