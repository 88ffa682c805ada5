"""Transports carry out plans; they never decide what goes where.

Slot for an RDMA engine (NIXL, Mooncake): a transport needs (1) a sender side that, given the
plan's transfers for its rank, exposes each box's bytes (`pack`), and (2) a receiver side that
hands each record's bytes to `tandem.exchange.receiver.apply_records`. An RDMA transport would
register the sender's staging memory with the engine library and let receivers read records by
(address, length) instead of mapping its shared memory; the plan, records, checksums and commit
protocol stay the same.
"""
