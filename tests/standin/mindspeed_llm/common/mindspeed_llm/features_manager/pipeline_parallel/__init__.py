"""Stand-in: MindSpeed-LLM pipeline-parallel features."""
