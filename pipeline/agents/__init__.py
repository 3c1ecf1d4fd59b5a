"""The research society: a LangGraph graph of nine roles that reach models only through the proxy."""
