"""Stand-in: MindSpeed-LLM tasks package."""
