"""The HTTP router: sends each request to the replica that holds its prefix."""
