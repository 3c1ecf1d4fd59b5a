"""Online RL of the senior roles through Agent Lightning (gateway, controller, agent entry point, trace store)."""
