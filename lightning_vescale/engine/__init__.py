"""The engine: RaggedShard placements, the planner, the sharded tensor type, DBuffer, parameter groups,
``fully_shard`` and the collectives. It imports torch only, never an extension, an applier or an integration
(docs/ARCHITECTURE.md); extensions plug in through the protocols its modules define."""
