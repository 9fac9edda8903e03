"""mega's own implementations of the lifecycle hooks, registered like any plugin's (each module
is an entry point): the metrics sinks, the plan check, the line saying a checkpoint was saved."""
