def start_sweeper_thread():
    pass
