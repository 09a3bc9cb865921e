"""How KV blocks move between processes: prefill -> decode hand-offs and KV-store gets and puts.

What the services use:

- ``handoff``: a prompt's KV from a prefill worker to its decode worker. :class:`HandoffSender`
  (prefill) picks the path and returns what the admitting ``DecodeRequest`` names (``RingSlots`` or
  ``KVTransfer``); :class:`HandoffReceiver` (decode) owns the worker's ring and the receiver of its
  frames, turns an admit's descriptor into KV blocks (``take``), gives back a refused admit's
  (``discard``) and reclaims the ring's lost slots.
- ``channel``: :class:`KVChannel`, a process's KV frames over NATS: sends a blob of blocks to a
  subject and returns its ``KVTransfer``, lands the frames sent to a subject, and owns the process's
  bulk connections. Torch-free (the KV-store's service side uses it).

Underneath:

- ``ring``: the same-host path, a pinned shared-memory ring of slots in /dev/shm (``ShmRing``);
- ``frames``: the cross-host path's wire, credited binary frames of checksummed blocks (``send_kv``,
  ``KVReceiver``);
- ``bulklinks`` and ``bulkconn``: the extra NATS connections frames travel on, read and written in
  place on threads of their own;
- ``devcopy``: host <-> device copies that never wait for the engine's stream (the engine uses them too).

The path a hand-off's block takes. Same host (the decode worker advertised a ring with this host's
id, the ring is on and has room within ``--kv-ring-wait-s``): GPU -> the decode worker's ring slots
(a thread's copy) -> ``RingSlots`` in the ``DecodeRequest`` -> the decode worker copies the slots into
device memory (a thread's copy) and frees them. Otherwise: GPU -> pinned host memory -> frames over
the prefill worker's bulk connections -> the decode worker's bulk connections land them in its
``KVReceiver``, checksumming each block -> the ``DecodeRequest`` names the ``KVTransfer`` -> its
checksums are compared and the bytes become the blocks. KV-store gets and puts take the second
path between a worker's channel and the store's.

Importing this package loads nothing: ``frames`` and ``channel`` stay free of torch.
"""
