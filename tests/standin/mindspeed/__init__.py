"""Stand-in for Ascend/MindSpeed (core_r0.12.1 line): only what MindSpeed-LLM's adaptor uses."""
