"""Tools that look at a run from outside: the host-sync counter (:mod:`lightning_moe.debug.host_syncs`)."""
