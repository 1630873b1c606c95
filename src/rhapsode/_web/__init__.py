"""
The web page of issue 15: C{rhapsode web} and C{twistd rhapsode-web} serve it, a client
of the core's public and management routes with no route of its own (protocol.md
section 13).  docs/web.md says how to open it and what each part does.
"""

from ._site import STATIC, WebConfig, WebSite, admit, make_site

__all__ = ["STATIC", "WebConfig", "WebSite", "admit", "make_site"]
