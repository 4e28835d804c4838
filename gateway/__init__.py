"""cachegw's gateway: the HTTP app, proxy, cache flow, admin and command line."""
