"""The half of benchmarks/argos_libretranslate.py that runs inside argostranslate's or
LibreTranslate's own virtual environment (it imports their packages, never jaxformer):
``VENV/bin/python benchmarks/argos_worker.py ANSWER.json < REQUEST.json`` (the answer goes to a
file, since argostranslate prints to stdout). Requests:

    {"do": "translate", "package": FILE, "from": "en", "to": "de", "lines": [...]}
        installs FILE (argostranslate.package.install_from_path) and translates each line
        with argostranslate.translate.translate (unless "translate": false); answers each
        line's translation and the sentences the package's sentence splitter made of it.
    {"do": "lt_format", "pairs": [[source, translation], ...]}
        what LibreTranslate's /translate makes of a translation: html.unescape of
        libretranslate.language.improve_translation_formatting (app.py's text path).
    {"do": "libretranslatepy", "url": URL, "from": "en", "to": "de", "text": "..."}
        the languages and a translation through the libretranslatepy client.

Settings come from the environment (ARGOS_CHUNK_TYPE, ARGOS_COMPUTE_TYPE, HOME, ...), which
the caller sets; nothing here reaches the network.
"""

import json
import sys


def translate(request: dict) -> dict:
    from argostranslate import package, translate

    package.install_from_path(request["package"])
    translation = translate.get_translation_from_codes(request["from"], request["to"])
    splitter = translation.underlying.sentencizer   # CachedTranslation → PackageTranslation
    lines = request["lines"] if request.get("translate", True) else []
    return {"translations": [translate.translate(line, request["from"], request["to"]) for line in lines],
            "sentences": [splitter.split_sentences(line) for line in request["lines"]],
            "splitter": str(splitter)}


def lt_format(request: dict) -> dict:
    from html import unescape

    from libretranslate.language import improve_translation_formatting

    return {"formatted": [unescape(improve_translation_formatting(source, text))
                          for source, text in request["pairs"]]}


def libretranslatepy(request: dict) -> dict:
    from libretranslatepy import LibreTranslateAPI

    api = LibreTranslateAPI(request["url"])
    return {"languages": api.languages(),
            "translation": api.translate(request["text"], request["from"], request["to"])}


if __name__ == "__main__":
    request = json.load(sys.stdin)
    answer = {"translate": translate, "lt_format": lt_format, "libretranslatepy": libretranslatepy}[
        request["do"]](request)
    with open(sys.argv[1], "w", encoding="utf-8") as out:
        json.dump(answer, out, ensure_ascii=False)
