"""One fleet: engine replicas behind one front (`tandem.llm.LLM`, `tandem serve`, `tandem
router`), the board of their states, the routing policy, the composite weight target that
updates them all (in waves or at once), quarantine, heal and peer pushes."""
