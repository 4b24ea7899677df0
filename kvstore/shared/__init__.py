"""The shared tier: blocks shared by a fleet on a Valkey / Redis Cluster.

- :mod:`.tier`: the tier (fetches on a miss, sends behind writes, backs off on faults).
- :mod:`.cluster`: the cluster client and its link.
- :mod:`.format`: how a block is stored on the cluster (key, header, checksum).
"""
