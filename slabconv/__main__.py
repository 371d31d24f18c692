from slabconv.cli import run

run()
