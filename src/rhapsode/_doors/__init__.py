"""
The doors: translations on top of the public API, each speaking through the speech
service and the public reads it is given as interfaces (L{rhapsode._interfaces}), never
through the router or another door.  The OpenAI shim and its discovery routes
(L{openai}), MCP (L{mcp}) and the WebSocket text-in stream (L{stream}).
"""
