//! The machinery behind the table of keys in `keys.rs`: a key, a section, the macros that
//! declare them, and what derives from them (lookup, environment variable names, the
//! example file `configs/netagg.cfg`).

use std::fmt::Write;

use crate::keys::{HEADER, SECTIONS};
use crate::kind::{Kind, Value};
use crate::Config;

/// What a key is, whatever holds its value.
#[derive(Debug)]
pub(crate) struct About {
    pub name: &'static str,
    pub kind: Kind,
    /// The comment above the key in configs/netagg.cfg, a line each; none where the
    /// comment above an earlier key speaks for this one too.
    pub doc: &'static [&'static str],
}

/// A key whose value an `S` holds (a section's struct).
pub(crate) struct Key<S> {
    pub about: About,
    pub load: fn(&S) -> Value,
    /// None where the value does not fit the field.
    pub store: fn(&mut S, Value) -> Option<()>,
}

impl<S> Key<S> {
    fn get(&self, holder: &S) -> String {
        self.about.kind.show(&(self.load)(holder))
    }

    /// Sets the key from `text`, or returns what it expects.
    pub(crate) fn set(&self, holder: &mut S, text: &str) -> Result<(), String> {
        self.about
            .kind
            .parse(text)
            .and_then(|value| (self.store)(holder, value))
            .ok_or_else(|| self.about.kind.expected())
    }
}

/// The key of `keys` named `name`.
pub(crate) fn find<'k, S>(keys: &'k [Key<S>], name: &str) -> Option<&'k Key<S>> {
    keys.iter().find(|key| key.about.name == name)
}

/// The names of `keys`, as unknown-key errors list them.
pub(crate) fn names<'k>(keys: impl Iterator<Item = &'k About>) -> String {
    keys.map(|about| about.name).collect::<Vec<_>>().join(", ")
}

/// A section of the file, whichever struct holds its keys.
pub(crate) trait Section: Sync {
    /// `general`, `backend.udp`, `switch.faults`.
    fn name(&self) -> &'static str;
    /// The comment below the section's header in configs/netagg.cfg, a line each.
    fn doc(&self) -> &'static [&'static str];
    /// Whether an unknown key in this section lists only this section's key names, as
    /// the fault sections do (`--faults` takes the same names), rather than every key.
    fn lists_own_keys(&self) -> bool;
    fn keys(&self) -> Box<dyn Iterator<Item = &'static About>>;
    /// The value of the key `name` in `config`.
    fn get(&self, config: &Config, name: &str) -> Option<String>;
    /// Sets the key `name` in `config` from `text`: None where there is no such key, an
    /// error saying what the key expects where it refuses `text`.
    fn set(&self, config: &mut Config, name: &str, text: &str) -> Option<Result<(), String>>;
}

/// A section whose keys an `S` in a [`Config`] holds.
pub(crate) struct SectionOf<S: 'static> {
    pub name: &'static str,
    pub doc: &'static [&'static str],
    pub lists_own_keys: bool,
    pub keys: &'static [Key<S>],
    pub of: fn(&Config) -> &S,
    pub of_mut: fn(&mut Config) -> &mut S,
}

impl<S: 'static> Section for SectionOf<S> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn doc(&self) -> &'static [&'static str] {
        self.doc
    }

    fn lists_own_keys(&self) -> bool {
        self.lists_own_keys
    }

    fn keys(&self) -> Box<dyn Iterator<Item = &'static About>> {
        Box::new(self.keys.iter().map(|key| &key.about))
    }

    fn get(&self, config: &Config, name: &str) -> Option<String> {
        Some(find(self.keys, name)?.get((self.of)(config)))
    }

    fn set(&self, config: &mut Config, name: &str, text: &str) -> Option<Result<(), String>> {
        Some(find(self.keys, name)?.set((self.of_mut)(config), text))
    }
}

/// The section `key` (`switch.faults.send_drop`) belongs to, and its name there
/// (`send_drop`): the longest section name it starts with.
pub(crate) fn section_of(key: &str) -> Option<(&'static dyn Section, &str)> {
    SECTIONS
        .iter()
        .filter_map(|section| Some((*section, key.strip_prefix(section.name())?.strip_prefix('.')?)))
        .max_by_key(|(section, _)| section.name().len())
}

/// The environment variable that sets `name` in `section`: `NETAGG_<SECTION>__<KEY>`,
/// upper case, a dot in the section becoming an underscore (`NETAGG_SWITCH_FAULTS__SEND_DROP`).
pub(crate) fn variable(section: &str, name: &str) -> String {
    format!("NETAGG_{}__{}", section.replace('.', "_"), name).to_ascii_uppercase()
}

/// The key (`general.rank`) that the environment variable `variable` sets, in any case.
pub(crate) fn key_of_variable(variable_name: &str) -> Option<String> {
    SECTIONS.iter().find_map(|section| {
        section
            .keys()
            .find(|about| variable(section.name(), about.name).eq_ignore_ascii_case(variable_name))
            .map(|about| format!("{}.{}", section.name(), about.name))
    })
}

/// configs/netagg.cfg: the header, then each section with its comment and its keys, each
/// with its comment and its default.
pub(crate) fn example_file() -> String {
    let defaults = Config::default();
    let mut text = String::new();
    comment(&mut text, HEADER.lines());
    for section in SECTIONS {
        let _ = write!(text, "\n[{}]\n", section.name());
        comment(&mut text, section.doc().iter().copied());
        for about in section.keys() {
            comment(&mut text, about.doc.iter().copied());
            let default = section.get(&defaults, about.name).unwrap_or_default();
            let _ = writeln!(text, "{} = {default}", about.name);
        }
    }
    text
}

/// Writes `lines` as comment lines, `# ` before each (the one space a doc comment's line
/// starts with is the space after `#`).
fn comment<'a>(text: &mut String, lines: impl Iterator<Item = &'a str>) {
    for line in lines {
        let line = line.strip_prefix(' ').unwrap_or(line);
        text.push('#');
        if !line.is_empty() {
            text.push(' ');
        }
        text.push_str(line);
        text.push('\n');
    }
}

/// Declares the keys of a section struct whose fields are all keys, each named as its
/// field: `KEYS: Struct { /// doc  field = default, kind; ... }`, then optionally
/// `+ field` for each field that holds a section of its own. Makes the table `KEYS` and
/// the struct's `Default`, from the keys' defaults.
macro_rules! struct_keys {
    (
        $table:ident: $holder:ident $(+ $section:ident)* {
            $(
                $(#[doc = $doc:literal])*
                $field:ident = $default:expr, $kind:expr;
            )*
        }
    ) => {
        $crate::table::keys_at! {
            $table: $holder {
                $(
                    $(#[doc = $doc])*
                    $field at $field, $kind;
                )*
            }
        }

        impl Default for $holder {
            fn default() -> Self {
                $holder { $($field: $default,)* $($section: Default::default(),)* }
            }
        }
    };
}

/// Declares keys held in fields of a struct that may be nested, and named otherwise:
/// `KEYS: Struct { /// doc  name at field.path, kind; ... }`. Makes the table `KEYS`;
/// the struct's `Default` is its own.
macro_rules! keys_at {
    (
        $table:ident: $holder:ident {
            $(
                $(#[doc = $doc:literal])*
                $name:ident at $($path:ident).+, $kind:expr;
            )*
        }
    ) => {
        pub(crate) const $table: &[$crate::table::Key<$holder>] = &[$(
            $crate::table::Key {
                about: $crate::table::About { name: stringify!($name), kind: $kind, doc: &[$($doc),*] },
                load: |holder| $crate::kind::Field::to_value(&holder.$($path).+),
                store: |holder, value| {
                    holder.$($path).+ = $crate::kind::Field::from_value(value)?;
                    Some(())
                },
            },
        )*];
    };
}

/// Declares the sections, in the file's order: `/// doc  "name" at field.path: KEYS;`,
/// with `, listing its own keys` where an unknown key lists only the section's names.
macro_rules! sections {
    (@own) => { false };
    (@own own) => { true };
    (
        $(
            $(#[doc = $doc:literal])*
            $name:literal at $($path:ident).+: $keys:ident $(, listing its $own:ident keys)?;
        )*
    ) => {
        pub(crate) const SECTIONS: &[&dyn $crate::table::Section] = &[$(
            &$crate::table::SectionOf {
                name: $name,
                doc: &[$($doc),*],
                lists_own_keys: $crate::table::sections!(@own $($own)?),
                keys: $keys,
                of: |config| &config.$($path).+,
                of_mut: |config| &mut config.$($path).+,
            },
        )*];
    };
}

pub(crate) use {keys_at, sections, struct_keys};
