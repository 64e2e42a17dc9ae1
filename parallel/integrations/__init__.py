"""Adapters that let RL frameworks drive :class:`reshard.LLM` through their own interfaces."""
