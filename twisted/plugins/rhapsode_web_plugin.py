# The twistd dropin for the web page: import-light, as every dropin must be.
from twisted.application.service import ServiceMaker

rhapsode_web = ServiceMaker(
    "Rhapsode web page", "rhapsode._web._tap", "A page to try voices and manage engines.", "rhapsode-web"
)
