//! A character-level corpus generated from a small grammar (nothing is downloaded): about 1 MB
//! of English-like sentences whose structure a small model learns in a few hundred steps, and
//! the samples every rank draws from it.

use candle_core::{Device, Result, Tensor};

const SUBJECTS: &[&str] = &[
    "the cat",
    "a dog",
    "my neighbour",
    "the old sailor",
    "a small bird",
    "the teacher",
    "every child",
    "the baker",
    "a quiet fox",
    "the farmer",
    "our captain",
    "the miller",
];
const VERBS: &[&str] = &[
    "sees",
    "follows",
    "paints",
    "carries",
    "finds",
    "watches",
    "feeds",
    "remembers",
    "builds",
    "greets",
    "chases",
    "mends",
];
const OBJECTS: &[&str] = &[
    "the red boat",
    "a loaf of bread",
    "the garden gate",
    "an old map",
    "the morning star",
    "a wooden chair",
    "the long road",
    "a letter",
    "the river bank",
    "a basket of apples",
];
const ENDINGS: &[&str] = &[
    "",
    " in the rain",
    " at dawn",
    " near the hill",
    " with great care",
    " before supper",
    " by the sea",
    " every sunday",
];

/// The generated text and its alphabet.
pub struct Corpus {
    /// The text as token ids (indices into `alphabet`).
    pub tokens: Vec<u32>,
    /// The distinct characters, sorted: token `i` is `alphabet[i]`.
    pub alphabet: Vec<char>,
}

impl Corpus {
    /// About `bytes` of text from the grammar, the same for a `seed` on every machine.
    pub fn generate(bytes: usize, seed: u64) -> Corpus {
        let mut text = String::with_capacity(bytes + 128);
        let mut s = seed;
        let mut pick = |list: &[&'static str]| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            list[(mix(s) % list.len() as u64) as usize]
        };
        while text.len() < bytes {
            let subject = pick(SUBJECTS);
            let (verb, object, ending) = (pick(VERBS), pick(OBJECTS), pick(ENDINGS));
            let mut first = subject.chars();
            let cap = first.next().map(|c| c.to_ascii_uppercase()).unwrap_or(' ');
            text.push(cap);
            text.push_str(first.as_str());
            text.push(' ');
            text.push_str(verb);
            text.push(' ');
            text.push_str(object);
            text.push_str(ending);
            text.push_str(if pick(&["", "", "", "\n"]).is_empty() {
                ". "
            } else {
                ".\n"
            });
        }
        let mut alphabet: Vec<char> = text.chars().collect();
        alphabet.sort_unstable();
        alphabet.dedup();
        let tokens = text
            .chars()
            .map(|c| alphabet.binary_search(&c).expect("in the alphabet") as u32)
            .collect();
        Corpus { tokens, alphabet }
    }

    /// Tokens in the vocabulary.
    pub fn vocab(&self) -> usize {
        self.alphabet.len()
    }

    /// Inputs and targets `(samples.len(), ctx)` for the numbered samples: sample `g` is the
    /// window at a position that depends only on `g` (so a global batch split across ranks
    /// draws exactly the samples one process would), its targets the next characters.
    pub fn batch(&self, samples: &[u64], ctx: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
        let span = (self.tokens.len() - ctx - 1) as u64;
        let mut x = Vec::with_capacity(samples.len() * ctx);
        let mut y = Vec::with_capacity(samples.len() * ctx);
        for &g in samples {
            let at = (mix(g ^ 0x5851_f42d_4c95_7f2d) % span) as usize;
            x.extend_from_slice(&self.tokens[at..at + ctx]);
            y.extend_from_slice(&self.tokens[at + 1..at + ctx + 1]);
        }
        Ok((
            Tensor::from_vec(x, (samples.len(), ctx), dev)?,
            Tensor::from_vec(y, (samples.len(), ctx), dev)?,
        ))
    }

    /// Text for token ids.
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter().map(|&i| self.alphabet[i as usize]).collect()
    }
}

/// splitmix64's finaliser.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_corpus_is_a_megabyte_of_the_same_text_every_time() {
        let a = Corpus::generate(1 << 20, 7);
        let b = Corpus::generate(1 << 20, 7);
        assert!(a.tokens.len() >= 1 << 20);
        assert_eq!(a.tokens, b.tokens);
        assert!(a.vocab() > 20 && a.vocab() < 64, "{}", a.vocab());
        assert!(a.decode(&a.tokens[..200]).contains(". "));
    }

    #[test]
    fn targets_are_the_next_characters() {
        let c = Corpus::generate(10_000, 1);
        let (x, y) = c.batch(&[3, 4], 16, &Device::Cpu).unwrap();
        let (x, y) = (x.to_vec2::<u32>().unwrap(), y.to_vec2::<u32>().unwrap());
        assert_eq!(x[0][1..], y[0][..15]);
        assert_ne!(x[0], x[1]);
    }
}
