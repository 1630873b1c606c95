# The twistd dropin: import-light on purpose (twistd imports every dropin to list them).
from twisted.application.service import ServiceMaker

rhapsode = ServiceMaker(
    "Rhapsode", "rhapsode._tap", "A multi-engine speech server.", "rhapsode"
)
