"""
The HTTP server both processes listen with, over twisted.web's parser: the site that
bounds a request at its head (L{site}), the answers a route writes (L{answers}) and the
multipart form reader for voice uploads (L{form}).
"""
