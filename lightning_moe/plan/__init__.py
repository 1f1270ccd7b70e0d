"""The pre-flight planner: predicted step time, throughput and the best layouts of a recipe (``lightning-moe plan``)."""
