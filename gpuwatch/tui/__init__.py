"""`gpuwatch top`: pure view state (state.py), pure text layout (render.py, fmt.py),
a thin curses screen (screen.py) and the Snapshot <-> JSON document (jsondoc.py)."""
