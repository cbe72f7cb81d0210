"""ComfyUI node classes (classic V1 API). Each node is its schema plus one call into the runtime."""
NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
