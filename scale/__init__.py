"""Past one machine: session ownership across processes and placement of runtime shards on Ray."""
