"""
The admin surface: the JSON API as a resource tree, its read-only views of
the fleet, the WebSocket watch stream and the fleet page's files.
"""
