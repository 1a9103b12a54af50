from channels.routing import URLRouter

websocket_application = URLRouter([])
