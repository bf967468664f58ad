"""`http_get.py URL`: prints the body of an HTTP GET (e.g. the agent's /metrics)."""
import sys
import urllib.request


def main():
    print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())


if __name__ == "__main__":
    main()
