"""The core's own plugins, registered through the same hooks as outside ones."""
