"""Real containers for the deployment tests: podman with a storage and settings of the project's own."""
