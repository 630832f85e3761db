"""How bytes move between a pipeline's processes: the session, the mailbox's messages, their codec, the data plane."""
