"""Outside witness: RFC 6962 Merkle tree over the log, signed checkpoints, cosignatures."""
