"""kvstored: the daemon around :class:`kvstore.store.Store`.

Modules: ``paths`` and ``hostinfo`` (stdlib only, imported by the client too),
``config`` (the key table and its layers), ``names`` (stable namespace names),
``convert`` (protobuf <-> core), ``errors`` (core errors -> status codes),
``service`` (the servicer), ``server`` (bind, health, reflection, graceful stop),
``main`` (the ``kvstored`` command). Importing this package imports nothing else.
"""
