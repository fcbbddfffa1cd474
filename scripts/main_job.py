"""The main job (`make run`): walk the default model through the toolkit and print one summary."""
