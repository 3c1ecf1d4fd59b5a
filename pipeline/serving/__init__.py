"""Serving plane: vLLM workers, the role-routing LiteLLM proxy, versioned routing."""
