"""An engine emulator: the simulator's engine model, in real time, behind the OpenAI API."""
