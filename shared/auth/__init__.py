"""The bus as a trust boundary: nats-server identities (operator, account, one role per kind of
process), subject permissions per role, and the credentials each process connects with.

``nkeys`` and ``jwt`` speak nats-server's formats; ``roles`` says who may do what; ``keyring``
makes a deployment's keys and its server config; ``credentials`` loads a process's credentials
and turns them into ``nats.connect`` options. No torch, no nats-py: the client library uses it.
"""
