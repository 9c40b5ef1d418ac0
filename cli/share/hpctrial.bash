# Bash completion for hpctrial: its verbs, each verb's actions and options, and file names.
# Everything but file names is read from the command's own help (`hpctrial --help`, `hpctrial
# VERB --help`), so that it is never out of date. Installed as
# PREFIX/share/bash-completion/completions/hpctrial, where bash-completion finds it through
# XDG_DATA_DIRS (which the hpctrial modulefile sets); or source this file.

# The verbs `hpctrial --help` lists.
_hpctrial_verbs() {
  "$1" --help 2>/dev/null | sed -n '/^verbs:/,/^$/s/^  \([a-z][a-z-]*\) .*/\1/p'
}

_hpctrial() {
  local program=${COMP_WORDS[0]} cur=${COMP_WORDS[COMP_CWORD]} verb=${COMP_WORDS[1]:-} words
  COMPREPLY=()
  if ((COMP_CWORD == 1)) || { [[ $verb == help ]] && ((COMP_CWORD == 2)); }; then
    words="$(_hpctrial_verbs "$program")"
    ((COMP_CWORD == 1)) && words+=" help --help --version"
    mapfile -t COMPREPLY < <(compgen -W "$words" -- "$cur")
    return 0
  fi
  [[ $verb == help ]] && return 0
  if [[ $cur == -* ]]; then
    words=$("$program" "$verb" --help 2>/dev/null | grep -o -- '--[a-z][a-z0-9-]*' | sort -u)
    mapfile -t COMPREPLY < <(compgen -W "$words" -- "$cur")
    return 0
  fi
  if ((COMP_CWORD == 2)); then
    # A verb's actions: the lowercase word after the verb on its usage lines (config show, ...).
    words=$("$program" "$verb" --help 2>/dev/null |
      sed -n "s/^\(usage:\)\{0,1\} *[^ ]*hpctrial $verb \([a-z][a-z-]*\)\( .*\)\{0,1\}$/\2/p" | sort -u)
    if [[ -n $words ]]; then
      mapfile -t COMPREPLY < <(compgen -W "$words" -- "$cur")
      return 0
    fi
  fi
  compopt -o filenames 2>/dev/null
  mapfile -t COMPREPLY < <(compgen -f -- "$cur")
  return 0
}

complete -F _hpctrial hpctrial
