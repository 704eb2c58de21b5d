"""Stand-in: MindSpeed-LLM training package."""
