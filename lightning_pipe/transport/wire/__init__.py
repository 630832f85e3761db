"""How bytes move between processes: the session, the mailbox's messages, their codec, the data plane, riders, lanes."""
